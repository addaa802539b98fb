"""Runs a scenario: each policy on a fresh cluster, store and virtual-time loop.

One policy run is one `VirtualTimeLoop` (`stoker.sim.vloop`): the simulated cluster,
every control-plane replica, the load driver, the invariant checker and the sampler share
it, and whenever every task waits the clock jumps to the next timer. Every time read goes through
the run's `LoopClock(epoch=view.epoch_s)`; the store is an in-memory SQLite database used from
the loop without threads. The same scenario and seed therefore replay the same run, and
give the same `summary.json` byte for byte.

Policies are independent runs, so `jobs > 1` runs them in that many forked processes at
once (each still deterministic); the progress of each reaches the caller's callback
either way. stoker's loggers are set to WARNING while a run lasts.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import queue
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from stoker.adapters.sqlite import SqliteStore
from stoker.domain.errors import ConfigError, InvalidRequest
from stoker.domain.ledger import LedgerCounts
from stoker.domain.specs import PoolSpec
from stoker.domain.states import WorkerState
from stoker.ports.clock import LoopClock
from stoker.ports.store import Store
from stoker.sim import vloop
from stoker.sim.claimlog import ClaimReplay
from stoker.sim.cluster import ClusterSnapshot, SimCluster
from stoker.sim.invariants import InvariantChecker, Violation, count_by
from stoker.sim.load import LoadDriver
from stoker.sim.passlog import PassLog
from stoker.sim.plane_specs import Limits, org_specs, plane_settings, pool_spec
from stoker.sim.replicas import PolicyReplicas, build_replicas
from stoker.sim.rollout import RolloutRun, strategy_for
from stoker.sim.scenario import Scenario
from stoker.sim.sessions import Attempt, quantiles

#: How many progress reports a policy run makes (the bar moves in these steps).
PROGRESS_STEPS = 200
#: Log lines a policy run keeps (the counts per event cover all of them).
LOG_LINES = 2000
#: The garbage collector's thresholds while a policy runs (Python's are 700, 10, 10).
GC_THRESHOLDS = (50_000, 20, 100)

#: The policy kinds that are stoker's own: their violations fail the scenario.
STOKER_KINDS = ("stoker", "stoker-reactive")

#: Progress of one policy: (policy name, virtual seconds done, virtual seconds in all).
ProgressCallback = Callable[[str, float, float], None]

_WORKER_STATES = tuple(s.value for s in WorkerState if s is not WorkerState.RETIRED)
_BUSY = (WorkerState.RESERVED.value, WorkerState.ACTIVATING.value, WorkerState.HOT.value)
_IDLE = (WorkerState.WARM.value, WorkerState.HOT_IDLE.value)


@dataclass
class PolicyResult:
    """What one policy run produced; `summary` is JSON-ready and deterministic."""

    name: str
    kind: str
    summary: dict[str, Any]
    samples: list[dict[str, Any]]
    latencies: dict[str, list[float]]
    violations: list[Violation]
    virtual_s: float
    wall_s: float
    #: Warnings stoker logged during the run: a count per event, and the first lines.
    warnings: dict[str, int] = field(default_factory=dict)
    log_lines: list[str] = field(default_factory=list)
    #: Every claim attempt (claims.jsonl) and the janitor's passes (passes.csv).
    attempts: list[Attempt] = field(default_factory=list)
    passes: PassLog = field(default_factory=PassLog)
    #: The claim timeout of each session whose tenant sets its own (others: the pool's).
    claim_timeouts: dict[int, float] = field(default_factory=dict)


@dataclass
class ScenarioResult:
    """Every policy run of a scenario, in the scenario's order."""

    scenario: Scenario
    short: bool
    policies: list[PolicyResult]
    wall_s: float = 0.0
    jobs: int = 1

    def stoker_violations(self) -> list[tuple[str, Violation]]:
        """Violations of runs of stoker's own policy (these fail the scenario)."""
        return [
            (result.name, violation)
            for result in self.policies
            if result.kind in STOKER_KINDS
            for violation in result.violations
        ]


# -- the whole scenario ----------------------------------------------------------------------


def run_scenario(
    scenario: Scenario,
    *,
    policies: Sequence[str] | None = None,
    short: bool = False,
    progress: ProgressCallback | None = None,
    jobs: int = 1,
    replay: ClaimReplay | None = None,
) -> ScenarioResult:
    """Run `policies` (all of the scenario's by default), each from scratch.

    `short` only labels the result (the scenario is loaded short by the caller). With a
    `replay` (recorded claims), every policy faces those claims instead of the tenants'.
    """
    names = list(policies) if policies else [p.name for p in scenario.policies]
    views = [scenario.for_policy(name) for name in names]
    for view in views:
        check_view(view)
    started = time.perf_counter()
    jobs = max(1, min(jobs, len(views)))
    if jobs == 1:
        results = [run_policy(view, progress=progress, replay=replay) for view in views]
    else:
        results = _run_forked(views, jobs, progress, replay)
    return ScenarioResult(
        scenario=scenario,
        short=short,
        policies=results,
        wall_s=time.perf_counter() - started,
        jobs=jobs,
    )


def check_view(view: Scenario) -> None:
    """Build the control plane's specs of a policy view before any run: a setting the
    scenario takes but the control plane refuses (a canary's steps out of order, a step
    interval over a day) is a ConfigError naming it, not a failure half-way through a run,
    nor a rollout that never starts."""
    where = f"scenario {view.name}: policy {view.policies[0].name!r}"
    try:
        pool_spec(view)
        org_specs(view)
        plane_settings(view)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if view.rollout is not None:
        try:
            strategy_for(view.policies[0], view.rollout)
        except InvalidRequest as exc:
            raise ConfigError(f"{where}: rollout.{exc}") from None
        if view.rollout.image == view.pool.image:
            raise ConfigError(
                f"{where}: rollout.image: the pool runs {view.pool.image!r} already: "
                "nothing to roll out"
            )


def _run_forked(
    views: list[Scenario],
    jobs: int,
    progress: ProgressCallback | None,
    replay: ClaimReplay | None = None,
) -> list[PolicyResult]:
    """Run policy views in `jobs` forked processes, relaying their progress (a replay
    reaches them through the fork, not pickled once per view)."""
    context = multiprocessing.get_context("fork")
    reports: multiprocessing.Queue[tuple[str, float, float]] = context.Queue()
    # The pool forks its workers here, before the relay thread exists.
    with context.Pool(jobs, initializer=_child_init, initargs=(reports, replay)) as pool:
        pending = [pool.apply_async(_child_run, (view,)) for view in views]
        stop = threading.Event()
        relay = threading.Thread(target=_relay, args=(reports, progress, stop), daemon=True)
        relay.start()
        try:
            results = [job.get() for job in pending]
        finally:
            stop.set()
            relay.join()
    return results


_child_reports: multiprocessing.Queue[tuple[str, float, float]] | None = None
_child_replay: ClaimReplay | None = None


def _child_init(
    reports: multiprocessing.Queue[tuple[str, float, float]], replay: ClaimReplay | None
) -> None:
    global _child_reports, _child_replay
    _child_reports = reports
    _child_replay = replay


def _child_run(view: Scenario) -> PolicyResult:
    reports = _child_reports

    def report(name: str, done: float, total: float) -> None:
        if reports is not None:
            reports.put((name, done, total))

    return run_policy(view, progress=report, replay=_child_replay)


def _relay(
    reports: multiprocessing.Queue[tuple[str, float, float]],
    progress: ProgressCallback | None,
    stop: threading.Event,
) -> None:
    while not stop.is_set():
        try:
            name, done, total = reports.get(timeout=0.1)
        except queue.Empty:
            continue
        if progress is not None:
            progress(name, done, total)


# -- one policy ------------------------------------------------------------------------------


def run_policy(
    view: Scenario,
    *,
    progress: ProgressCallback | None = None,
    replay: ClaimReplay | None = None,
) -> PolicyResult:
    """Run one policy view (`Scenario.for_policy`) on a fresh virtual-time loop.

    stoker's loggers are at WARNING meanwhile, and what they log goes to the result (a
    count per event and the first lines), not to the terminal.
    """
    logger = logging.getLogger("stoker")
    level, propagate = logger.level, logger.propagate
    capture = _Capture()
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    logger.addHandler(capture)
    loop = vloop.new_event_loop()
    started = time.perf_counter()
    # A run allocates many short-lived objects among a large, long-lived heap (the
    # cluster, the store's rows): collecting the young generation every 700 allocations
    # costs about a sixth of a day-long run. Rarer collections; the old settings after.
    thresholds = gc.get_threshold()
    gc.set_threshold(GC_THRESHOLDS[0], *GC_THRESHOLDS[1:])
    try:
        result = loop.run_until_complete(_PolicyRun(view, progress, loop, replay).run())
    finally:
        gc.set_threshold(*thresholds)
        _close(loop)
        logger.removeHandler(capture)
        logger.setLevel(level)
        logger.propagate = propagate
    result.wall_s = time.perf_counter() - started
    result.warnings = dict(sorted(capture.counts.items()))
    result.log_lines = capture.lines
    return result


class _Capture(logging.Handler):
    """Counts log records by their `event=` name and keeps the first `LOG_LINES`."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: Counter[str] = Counter()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        head = message.split(" ", 1)[0]
        self.counts[head.removeprefix("event=") if head.startswith("event=") else "other"] += 1
        if len(self.lines) < LOG_LINES:
            self.lines.append(f"{record.levelname} {record.name} {message}")


def _close(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what is left on the loop, then close it."""
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


class _PolicyRun:
    """The parts of one policy run and the loop that drives them."""

    def __init__(
        self,
        view: Scenario,
        progress: ProgressCallback | None,
        loop: asyncio.AbstractEventLoop,
        replay: ClaimReplay | None = None,
    ) -> None:
        self.view = view
        self.replay = replay
        self.entry = view.policies[0]
        self.progress = progress
        # Bound to the run's loop: every part of the run reads it, hundreds of thousands
        # of times a simulated day.
        # The wall-clock origin is fixed (the scenario's), so timestamps in the store, and
        # everything derived from them, repeat from run to run.
        self.clock = LoopClock(epoch=view.epoch_s, loop=loop)
        self.pool: PoolSpec = pool_spec(view)
        self.samples: list[dict[str, Any]] = []
        self.no_leader_s = 0.0
        self.peaks: Counter[str] = Counter()
        self.integrals: Counter[str] = Counter()
        self.passes = PassLog()
        self.tasks: list[asyncio.Future[None]] = []
        #: The sampler's and the pass log's tasks, while the run goes on.
        self._background: tuple[asyncio.Future[None], ...] = ()

    def now(self) -> float:
        """Seconds since the run started (the loop starts at 0)."""
        return self.clock.monotonic()

    async def run(self) -> PolicyResult:
        """Build, start, drive for the scenario's duration, measure, stop."""
        view = self.view
        cluster = SimCluster(view.cluster_config(), clock=self.clock, rng=random.Random(view.seed))
        store = SqliteStore(":memory:")
        await store.open()
        pool = self.pool
        limits = Limits.of(view, pool)
        checker = InvariantChecker(
            now=self.now,
            wall=self.clock.now,
            pools={pool.name: pool},
            pool_cap=limits.pool_cap,
            org_cap=limits.org_cap,
            floor=limits.floor,
            pass_s=view.control_plane.reaper_interval_s,
            check_interval_s=view.check_interval_s,
        )
        cluster.api.add_listener(checker.pod_changed)
        replicas = build_replicas(
            scenario=view, cluster=cluster, store=store, clock=self.clock, observer=checker
        )
        await cluster.start()
        for plane in replicas.planes:
            await plane.start()
        driver = LoadDriver(
            tenants=view.tenants,
            pool=pool.name,
            targets=replicas.planes,
            clock=self.clock,
            seed=view.seed,
            observer=checker,
            target_hot=view.target_hot,
            replay=self.replay,
            until_s=view.duration_s,
        )
        driver.start()
        checker.start()
        rollout = None
        if view.rollout is not None:
            cap = limits.pool_cap(pool.name)
            rollout = RolloutRun(view.rollout, self.entry, replicas, store, checker, cap=cap)
            self.tasks.append(asyncio.ensure_future(rollout.run()))
        if replicas.kpa is not None:
            replicas.kpa.observe(lambda: driver.active + driver.waiting)
            self.tasks.append(asyncio.ensure_future(replicas.kpa.run(self.now)))
        sampler = asyncio.ensure_future(self._sample_every(cluster, store, replicas, driver))
        passes = asyncio.ensure_future(
            self.passes.run(
                interval_s=view.control_plane.janitor_interval_s,
                pool=pool.name,
                now=self.now,
                store=store,
                replicas=replicas,
                driver=driver,
            )
        )
        self._background = (sampler, passes)
        try:
            await self._drive(cluster, driver)
            await self._sample(cluster, store, replicas, driver)
            checker.check()
            summary = self._summary(cluster, store, replicas, driver, checker)
            # What the run did by its end: reading the ledger below takes store round
            # trips, during which sessions (and the sampler and checker) go on.
            ended = PolicyResult(
                name=self.entry.name,
                kind=self.entry.policy,
                summary=summary,
                samples=list(self.samples),
                latencies={k: list(v) for k, v in sorted(driver.stats.latencies.items())},
                violations=list(checker.violations),
                virtual_s=view.duration_s,
                wall_s=0.0,
                attempts=list(driver.log.attempts),
                passes=replace(self.passes, rows=list(self.passes.rows)),
                claim_timeouts=dict(driver.log.timeouts),
            )
            summary["ledger"] = await self._ledger(store, replicas)
            if rollout is not None:
                summary["rollout"] = rollout.summary(ended.attempts)
        finally:
            for task in (sampler, passes, *self.tasks):
                task.cancel()
            await asyncio.gather(sampler, passes, *self.tasks, return_exceptions=True)
            await driver.stop()
            await checker.stop()
            for plane in replicas.planes:
                await plane.stop()
            await cluster.stop()
            await store.close()
        return ended

    async def _drive(self, cluster: SimCluster, driver: LoadDriver) -> None:
        """Let the run go on for the scenario's duration, reporting progress."""
        total = self.view.duration_s
        step = total / PROGRESS_STEPS
        while (left := total - self.now()) > 1e-9:
            await asyncio.sleep(min(step, left))
            cluster.raise_if_failed()
            driver.raise_if_failed()
            self._raise_if_a_task_failed()
            if self.progress is not None:
                self.progress(self.entry.name, min(self.now(), total), total)

    def _raise_if_a_task_failed(self) -> None:
        """Re-raise the error of a part of the run that ended with one (the rollout, the
        KPA, the sampler, the pass log): its figures would be missing from the summary
        without a word."""
        for task in (*self.tasks, *self._background):
            if task.done() and not task.cancelled() and (exc := task.exception()) is not None:
                raise RuntimeError(f"a part of the run failed: {exc}") from exc

    # -- the timeseries ------------------------------------------------------------------------

    async def _sample_every(
        self, cluster: SimCluster, store: Store, replicas: PolicyReplicas, driver: LoadDriver
    ) -> None:
        interval = self.view.sample_interval_s
        while True:
            await asyncio.sleep(interval)
            await self._sample(cluster, store, replicas, driver)

    async def _sample(
        self, cluster: SimCluster, store: Store, replicas: PolicyReplicas, driver: LoadDriver
    ) -> None:
        """One row of the timeseries, and the integrals and peaks it feeds."""
        t = round(self.now(), 6)
        if self.samples and self.samples[-1]["t_s"] == t:
            return
        elapsed = t - (self.samples[-1]["t_s"] if self.samples else 0.0)
        counts = dict.fromkeys(_WORKER_STATES, 0)
        for count in await store.count_workers():
            counts[count.state.value] += count.count
        snap = cluster.snapshot()
        nodes = snap.nodes_by_state
        cpu = self.view.pool.cpu_cores
        alive = sum(n for state, n in nodes.items() if state != "terminated")
        leader = replicas.leader()
        janitor = replicas.planes[leader].janitor if leader is not None else None
        row: dict[str, Any] = {"t_s": t, **counts}
        row.update(
            {
                "live": sum(counts.values()),
                "nodes": alive,
                "nodes_ready": nodes.get("ready", 0),
                "nodes_launching": nodes.get("launching", 0),
                "nodes_draining": nodes.get("draining", 0),
                "nodes_reclaimed": snap.consolidated_empty_total
                + snap.consolidated_underutilized_total,
                "pods_pending": snap.pods_by_phase.get("Pending", 0),
                "pods_unschedulable": snap.pods_unschedulable,
                "sessions_active": driver.active,
                "claims_waiting": driver.waiting,
                "warm_target": self.pool.warm_target,
                "desired_warm": None if janitor is None else janitor.desired.get(self.pool.name),
                "demand": None if janitor is None else janitor.demand.get(self.pool.name),
                "busy_vcpu": sum(counts[s] for s in _BUSY) * cpu,
                "idle_vcpu": sum(counts[s] for s in _IDLE) * cpu,
                "placeholder_vcpu": _label_cpu(snap, "stoker.dev/placeholder"),
                "node_vcpu": snap.allocatable.cpu + snap.allocatable_launching.cpu,
                "background_vcpu": _background_cpu(snap),
                "leader": -1 if leader is None else leader,
                "cost_usd": snap.node_cost_usd,
            }
        )
        self.samples.append(row)
        for key in ("busy_vcpu", "idle_vcpu", "placeholder_vcpu", "node_vcpu"):
            self.integrals[key] += row[key] * elapsed / 3600
        for key in ("live", "nodes", "hot", "hot_idle", "warm", "pods_pending"):
            self.peaks[key] = max(self.peaks[key], row[key])
        if leader is None:
            self.no_leader_s += elapsed

    # -- the summary ---------------------------------------------------------------------------

    async def _ledger(self, store: Store, replicas: PolicyReplicas) -> dict[str, float]:
        """The pool's ledger over the whole run (docs/warmth.md), every replica's cells
        summed: what the live fleet's `GET /v1/pools/{name}/ledger` would have said. Each
        replica writes its last counts first, as a clean stop does."""
        for plane in replicas.planes:
            await plane.ledger.flush(store)
        start = self.clock.now() - self.view.duration_s
        rows = await store.read_ledger(self.pool.name, since=start, until=self.clock.now())
        total = LedgerCounts()
        for _, counts in rows:
            total.merge(counts)
        return total.scalars()

    def _summary(
        self,
        cluster: SimCluster,
        store: Store,
        replicas: PolicyReplicas,
        driver: LoadDriver,
        checker: InvariantChecker,
    ) -> dict[str, Any]:
        stats = driver.stats
        snap = cluster.snapshot()
        bound = stats.bound
        by_source = {source: len(samples) for source, samples in stats.latencies.items()}
        served_warm = by_source.get("warm", 0) + by_source.get("reuse", 0)
        every = [x for samples in stats.latencies.values() for x in samples]
        last = self.samples[-1] if self.samples else {}
        retirements = _counter(replicas, "stoker_retirements", "reason")
        pod_starts = replicas.pod_starts()
        electors = replicas.electors
        return {
            "policy": self.entry.policy,
            "replicas": len(replicas.planes),
            "claims": {
                "attempts": bound + sum(stats.failures.values()),
                "bound": bound,
                "by_source": dict(sorted(by_source.items())),
                "failures": dict(sorted(stats.failures.items())),
                "latency_s": {
                    **{src: quantiles(xs) for src, xs in sorted(stats.latencies.items())},
                    "all": quantiles(every),
                },
                "warm_hit_ratio": served_warm / bound if bound else None,
                "cold_share": by_source.get("cold", 0) / bound if bound else None,
            },
            "sessions": {
                "started": stats.sessions,
                "lost": stats.sessions_lost,
                "failed": stats.sessions_failed,
                "reopened": stats.sessions_reopened,
                "abandoned": stats.abandoned,
                "released": stats.released,
                "renewals": stats.renewals,
                "renew_errors": stats.renew_errors,
                "release_errors": stats.release_errors,
                "peak_bound": stats.peak_bound,
                **driver.log.summary(self.now(), self.view.pool.claim_timeout_s),
                "waiting_with_warm_passes": self.passes.waiting_with_warm,
            },
            "target_hot": self.view.target_hot,
            "time_to_target_s": stats.time_to_target_s,
            "vcpu_hours": {
                "busy": self.integrals["busy_vcpu"],
                "idle": self.integrals["idle_vcpu"],
                "placeholder": self.integrals["placeholder_vcpu"],
                "nodes": self.integrals["node_vcpu"],
            },
            "workers": {
                "spawns": _counter(replicas, "stoker_spawns", "purpose"),
                "spawn_failures": _counter(replicas, "stoker_spawn_failures", "reason"),
                "retirements": retirements,
                "retired": sum(retirements.values()),
                "final": {s: last.get(s, 0) for s in _WORKER_STATES},
                "peak": {k: self.peaks[k] for k in ("hot", "hot_idle", "live", "warm")},
                "pod_start_s": quantiles(pod_starts),
                "activations": replicas.activator.activations,
                "activation_rejections": replicas.activator.rejections,
                "activation_failures": replicas.activator.failures,
            },
            "nodes": {
                "launched": snap.nodes_launched_total,
                "terminated": snap.nodes_terminated_total,
                "reclaimed": snap.consolidated_empty_total + snap.consolidated_underutilized_total,
                "peak": self.peaks["nodes"],
                "final": last.get("nodes", 0),
                "final_vcpu": last.get("node_vcpu", 0.0),
                "reclaimed_last_half": last.get("nodes_reclaimed", 0)
                - self._at_half("nodes_reclaimed"),
                "cost_usd": snap.node_cost_usd,
                "cost_usd_per_day": snap.node_cost_usd * 86_400 / self.view.duration_s,
                "peak_pending_pods": self.peaks["pods_pending"],
                "preemptions": snap.preemptions_total,
                "evictions": snap.evictions_total,
            },
            "background": {
                "target_cores": snap.background.target_cpu,
                "desired_cores": snap.background.desired_cpu,
                "bound_cores": last.get("background_vcpu", 0.0),
                "desired_pods": snap.background.desired_pods,
                "live_pods": snap.background.live_pods,
                "pods_replaced": snap.background.pods_replaced,
                "pods_destroyed": snap.background.pods_destroyed,
            },
            "leadership": {
                "terms": sum(getattr(e, "terms", 0) for e in _inner_electors(electors)),
                "max_concurrent_leaders": checker.max_concurrent_leaders,
                "time_without_leader_s": self.no_leader_s,
            },
            "invariants": {
                "checks": checker.checks,
                "violations": len(checker.violations),
                "by_invariant": count_by(checker.violations),
            },
        }

    def _at_half(self, key: str) -> Any:
        """The sample's `key` at half the run (0 before any sample)."""
        half = self.view.duration_s / 2
        value: Any = 0
        for row in self.samples:
            if row["t_s"] > half:
                break
            value = row[key]
        return value


def _inner_electors(electors: Iterable[object]) -> list[object]:
    """The lease electors themselves (a run-once wrapper holds its elector as `inner`)."""
    return [getattr(e, "inner", e) for e in electors]


def _counter(replicas: PolicyReplicas, name: str, label: str) -> dict[str, int]:
    """A Prometheus counter of every replica, summed by one label."""
    totals: Counter[str] = Counter()
    for plane in replicas.planes:
        for family in plane.metrics.registry.collect():
            if family.name != name:
                continue
            for sample in family.samples:
                if sample.name == f"{name}_total":
                    totals[sample.labels[label]] += int(sample.value)
    return dict(sorted(totals.items()))


def _label_cpu(snap: ClusterSnapshot, key: str) -> float:
    return sum(r.cpu for r in snap.requested_by_label.get(key, {}).values())


def _background_cpu(snap: ClusterSnapshot) -> float:
    stoker = _label_cpu(snap, "stoker.dev/pool") + _label_cpu(snap, "stoker.dev/placeholder")
    return max(0.0, snap.requested.cpu - stoker)
