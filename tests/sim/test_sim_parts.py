"""The simulated cluster's building blocks: quantities, capacity, distributions, indices,
budgets, the timeline and the configuration's YAML form."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from stoker.domain.errors import ConfigError
from stoker.ports.clock import LoopClock
from stoker.ports.cluster import Toleration
from stoker.sim import vloop
from stoker.sim.cluster.client import FaultKind, TokenBucket
from stoker.sim.cluster.config import SimClusterConfig
from stoker.sim.cluster.distributions import (
    BIGFLEET_REPLICAS,
    BIGFLEET_STATEFUL_REPLICAS,
    Constant,
    Distribution,
    Exponential,
    LogNormal,
    Uniform,
    distribution_from,
)
from stoker.sim.cluster.freeindex import FreeIndex, best_fit
from stoker.sim.cluster.model import PodDisruptionBudget
from stoker.sim.cluster.resources import (
    INSTANCE_TYPES_BY_NAME,
    InstanceType,
    cpu_millis,
    memory_bytes,
)
from stoker.sim.cluster.specs import (
    ConsolidationPolicy,
    PdbSpec,
    Taint,
    WorkloadKind,
    budget_of,
    tolerates,
)
from stoker.sim.cluster.timeline import Timeline, Trigger
from stoker.sim.cluster.workloads import DiurnalProfile, StepProfile

# -- quantities and capacity -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "millis"),
    [("1", 1000), ("500m", 500), ("2.2", 2200), ("0.0001", 1), ("100u", 1), ("3k", 3_000_000)],
)
def test_cpu_quantities_round_up_to_a_millicore(text: str, millis: int) -> None:
    """As the API server does: no request is smaller than what it asks for."""
    assert cpu_millis(text) == millis


@pytest.mark.parametrize(
    ("text", "size"),
    [("1Gi", 1 << 30), ("512Mi", 512 << 20), ("8.5Gi", 17 << 29), ("1e3", 1000), ("1M", 10**6)],
)
def test_memory_quantities_are_exact(text: str, size: int) -> None:
    """Binary and decimal suffixes and exponents, in exact integer bytes."""
    assert memory_bytes(text) == size


@pytest.mark.parametrize("text", ["", "1Zi", "-1", "lots"])
def test_invalid_quantities_are_refused(text: str) -> None:
    """A quantity the API server would reject is a configuration error."""
    with pytest.raises(ConfigError):
        cpu_millis(text)


def test_allocatable_follows_the_karpenter_formulas() -> None:
    """kube-reserved CPU by the EKS steps; memory minus overhead, reserve and eviction."""
    m5_xlarge = INSTANCE_TYPES_BY_NAME["m5.xlarge"].allocatable()
    assert m5_xlarge.cpu_m == 4000 - (60 + 10 + 5 * 2)
    reserved = (11 * 110 + 255 + 100) << 20
    assert m5_xlarge.memory_b == int(16 * (1 << 30) * 0.925) - reserved
    assert m5_xlarge.pods == 110
    big = InstanceType("big", cpu=64, memory_gib=256, price_per_hour=3.0)
    assert big.allocatable(daemon_cpu_m=125).cpu_m == 64_000 - (60 + 10 + 10 + 150) - 125


# -- distributions ---------------------------------------------------------------------------


def test_draws_depend_only_on_the_seed() -> None:
    """The same generator state gives the same draws; nothing global is consumed."""
    kinds: list[Distribution] = [
        Uniform(1, 2),
        Exponential(5),
        LogNormal(10, 0.5, cap=20),
        BIGFLEET_REPLICAS,
    ]
    first = [kind.sample(random.Random(3)) for kind in kinds]
    random.seed(99)  # the module-level generator must not matter
    assert [kind.sample(random.Random(3)) for kind in kinds] == first
    assert Constant(4).sample(random.Random(0)) == 4


def test_bigfleet_replica_buckets_have_the_documented_mean() -> None:
    """55:[1,5] 30:[6,25] 12:[26,100] 3:[101,400]; StatefulSets capped at 25."""
    assert BIGFLEET_REPLICAS.mean == pytest.approx(
        0.55 * 3 + 0.30 * 15.5 + 0.12 * 63 + 0.03 * 250.5
    )
    capped = BIGFLEET_STATEFUL_REPLICAS
    assert capped.mean == pytest.approx(0.55 * 3 + 0.30 * 15.5 + 0.12 * 25 + 0.03 * 25)
    draws = [capped.sample(random.Random(seed)) for seed in range(200)]
    assert max(draws) <= 25 and min(draws) >= 1


def test_lognormal_draws_respect_the_cap_and_the_median() -> None:
    """About half the draws fall below the median; none above the cap."""
    rng = random.Random(5)
    shape = LogNormal(60, 0.35, cap=80)
    draws = [shape.sample(rng) for _ in range(2000)]
    assert max(draws) <= 80
    assert 0.45 < sum(draw < 60 for draw in draws) / len(draws) < 0.55


def test_distributions_are_read_from_their_yaml_form() -> None:
    """A number is a constant; mappings name their kind; mistakes are ConfigErrors."""
    assert distribution_from(3) == Constant(3.0)
    assert distribution_from({"kind": "uniform", "low": 1, "high": 2}) == Uniform(1.0, 2.0)
    assert distribution_from({"kind": "lognormal", "median": 60, "sigma": 0.35}) == LogNormal(
        60.0, 0.35
    )
    parsed = distribution_from({"kind": "buckets", "buckets": [[1, 2, 3]], "cap": 2})
    assert parsed.sample(random.Random(1)) == 2
    for bad in (
        {"kind": "uniform", "low": 1},
        {"kind": "poisson"},
        {"kind": "exponential", "mean": 1, "x": 2},
        "5",
        True,
        {"kind": "uniform", "low": 3, "high": 1},
    ):
        with pytest.raises(ConfigError):
            distribution_from(bad)


# -- indices, budgets, taints ----------------------------------------------------------------


class _Slot:
    def __init__(self, name: str, free_cpu: int, free_mem: int = 1 << 30) -> None:
        self.name = name
        self.alloc_cpu = 4000
        self.alloc_mem = 1 << 32
        self.free_cpu = free_cpu
        self.free_mem = free_mem
        self.free_pods = 10
        self.bucket = -1
        self.labels: dict[str, str] = {}


def test_the_free_index_finds_the_tightest_fit_without_scanning_everything() -> None:
    """Candidates start at the bucket of the request and climb; updates re-bucket."""
    index: FreeIndex[_Slot] = FreeIndex(granularity_m=100)
    slots = [_Slot("roomy", 3000), _Slot("tight", 550), _Slot("full", 50), _Slot("mid", 1500)]
    for slot in slots:
        index.add(slot)
    assert [slot.name for slot in index.candidates(500)] == ["tight", "mid", "roomy"]
    assert best_fit(index, 500, 1 << 20, candidates=8) is slots[1]
    assert best_fit(index, 600, 1 << 20, candidates=8) is slots[3]
    slots[1].free_cpu = 2000
    index.update(slots[1])
    assert [slot.name for slot in index.candidates(1000)] == ["mid", "tight", "roomy"]
    index.discard(slots[0])
    assert len(index) == 3 and slots[0] not in index
    assert best_fit(index, 10_000, 0, candidates=8) is None
    assert best_fit(index, 100, 1 << 31, candidates=8) is None  # memory does not fit


@pytest.mark.parametrize(
    ("budget", "nodes", "allowed"),
    [("10%", 10, 1), ("10%", 11, 2), ("10%", 0, 0), ("20%", 3, 1), ("5", 100, 5), ("0", 9, 0)],
)
def test_node_budgets_round_percentages_up(budget: str, nodes: int, allowed: int) -> None:
    """Karpenter's `nodes:` budget: a count, or a percentage of the pool rounded up."""
    assert budget_of(budget, nodes) == allowed


def test_invalid_budgets_are_refused() -> None:
    """Neither a count nor a percentage."""
    for bad in ("ten", "-1", "-5%"):
        with pytest.raises(ConfigError):
            budget_of(bad, 10)


def test_tolerations_match_as_in_kubernetes() -> None:
    """Equal needs key and value; Exists needs the key (or none, for everything)."""
    taint = Taint("dedicated", "workers", "NoSchedule")
    assert tolerates((Toleration(key="dedicated", value="workers"),), taint)
    assert not tolerates((Toleration(key="dedicated", value="other"),), taint)
    assert tolerates((Toleration(key="dedicated", operator="Exists"),), taint)
    assert tolerates((Toleration(operator="Exists"),), taint)
    assert not tolerates((Toleration(operator="Exists", effect="NoExecute"),), taint)
    assert not tolerates((), taint)


def test_pdb_arithmetic_follows_the_disruption_controller() -> None:
    """minAvailable and maxUnavailable, integers and percentages rounded up."""

    def allowed(spec: PdbSpec, healthy: int, expected: int) -> int:
        budget = PodDisruptionBudget(spec, "ns", expected=lambda: expected)
        budget.healthy = healthy
        return budget.disruptions_allowed()

    assert allowed(PdbSpec("a", min_available=2), healthy=3, expected=3) == 1
    assert allowed(PdbSpec("a", min_available="50%"), healthy=3, expected=3) == 1  # ceil 1.5
    assert allowed(PdbSpec("a", max_unavailable=1), healthy=4, expected=4) == 1
    assert allowed(PdbSpec("a", max_unavailable=1), healthy=3, expected=4) == 0
    assert allowed(PdbSpec("a", max_unavailable="25%"), healthy=8, expected=8) == 2
    assert allowed(PdbSpec("a", max_unavailable="25%"), healthy=5, expected=5) == 2  # ceil 1.25
    with pytest.raises(ConfigError):
        PdbSpec("both", min_available=1, max_unavailable=1)
    with pytest.raises(ConfigError):
        PdbSpec("neither")


def test_a_token_bucket_reserves_tokens_in_order() -> None:
    """Burst first, then one token per 1/qps; waits grow for callers in the same instant."""
    bucket = TokenBucket(qps=4, burst=2)
    assert [bucket.reserve(0.0) for _ in range(4)] == [0.0, 0.0, 0.25, 0.5]
    assert bucket.reserve(10.0) == 0.0


# -- profiles and the timeline ---------------------------------------------------------------


def test_demand_profiles() -> None:
    """Diurnal peaks at `peak_s` and bottoms 12 h later; steps hold their last value."""
    day = DiurnalProfile(low=100, high=300, peak_s=14 * 3600)
    assert day.at(14 * 3600) == pytest.approx(300)
    assert day.at(2 * 3600) == pytest.approx(100)
    assert day.at(8 * 3600) == pytest.approx(200)
    steps = StepProfile(((10.0, 5.0), (20.0, 7.0)))
    assert [steps.at(t) for t in (0, 10, 15, 20, 99)] == [0.0, 5.0, 5.0, 7.0, 7.0]


@pytest.mark.looptime
async def test_the_timeline_runs_actions_on_its_grid_in_order() -> None:
    """Times round up to the grid; one tick's actions run in the order they were given."""
    timeline = Timeline(LoopClock(epoch=0.0), tick_s=0.5)
    seen: list[tuple[float, str]] = []
    loop = asyncio.get_running_loop()

    def note(label: str) -> None:
        seen.append((loop.time(), label))

    timeline.at(1.2, lambda: note("b"))
    timeline.at(1.5, lambda: note("c"))
    timeline.at(0.0, lambda: note("a"))
    timeline.start()
    trigger = Trigger(timeline, lambda: note("pass"))
    trigger.at(3.0)
    trigger.at(2.1)  # earlier: wins; the later request is already covered
    trigger.at(2.6)
    await asyncio.sleep(5)
    await timeline.stop()
    assert seen == [(0.0, "a"), (1.5, "b"), (1.5, "c"), (2.5, "pass")]


@pytest.mark.looptime
async def test_a_failing_action_stops_the_timeline_and_is_reported() -> None:
    """An inconsistent model must not keep running; the error surfaces on request."""
    timeline = Timeline(LoopClock(epoch=0.0), tick_s=1.0)
    ran: list[int] = []
    timeline.start()

    def boom() -> None:
        raise KeyError("broken")

    timeline.at(1, boom)
    timeline.at(2, lambda: ran.append(2))
    await asyncio.sleep(5)
    assert ran == [] and not timeline.running
    with pytest.raises(RuntimeError) as failure:
        timeline.raise_if_failed()
    assert isinstance(failure.value.__cause__, KeyError)
    await timeline.stop()


# -- the configuration's YAML form -----------------------------------------------------------


def test_a_full_configuration_is_read_from_a_mapping() -> None:
    """Every section of the YAML form lands in its dataclass."""
    config = SimClusterConfig.from_mapping(
        {
            "namespace": "workers",
            "tick_s": 0.25,
            "priority_classes": {"stoker-worker": 10000},
            "node_pools": [
                {
                    "name": "workers",
                    "instance_types": [
                        "m5.xlarge",
                        {"name": "huge", "cpu": 96, "memory_gib": 384, "price_per_hour": 4.6},
                    ],
                    "labels": {"stoker.dev/nodes": "workers"},
                    "taints": [{"key": "dedicated", "value": "workers"}],
                    "consolidation_policy": "WhenEmpty",
                    "consolidate_after_s": "Never",
                    "budget_nodes": "5",
                    "initial_nodes": {"m5.xlarge": 2},
                    "provisioning": {"kind": "uniform", "low": 30, "high": 90},
                }
            ],
            "scheduler": {"bind_rate": 25, "preemption": False},
            "kubelet": {"container_start": 3, "image_pull_by_image": {"pause": 1}},
            "autoscaler": {"batch_max_s": 5},
            "controllers": {"qps": 100, "burst": 200},
            "background": {
                "target": {"kind": "diurnal", "low": 100, "high": 300},
                "archetypes": ["tiny-stateless", {"name": "stateful-db", "machine_share": 5}],
                "churn_per_minute": 0.02,
            },
            "api": {"client_qps": 20, "client_latency": {"kind": "constant", "value": 0.01}},
            "faults": [{"at": 600, "duration": 30, "kind": "lease_blip", "client": "replica-1"}],
            "track_labels": ["stoker.dev/pool"],
        }
    )
    (workers,) = config.node_pools
    assert [t.name for t in workers.instance_types] == ["m5.xlarge", "huge"]
    assert workers.consolidate_after_s is None
    assert workers.consolidation_policy is ConsolidationPolicy.WHEN_EMPTY
    assert workers.taints == (Taint("dedicated", "workers"),)
    assert workers.provisioning == Uniform(30.0, 90.0)
    assert config.scheduler.bind_rate == 25 and not config.scheduler.preemption
    assert config.kubelet.container_start == Constant(3.0)
    assert config.background.archetypes[1].machine_share == 5
    assert config.background.archetypes[1].kind is WorkloadKind.STATEFULSET
    assert config.background.target == DiurnalProfile(100.0, 300.0)
    assert config.api.client_latency == Constant(0.01)
    assert config.faults[0].kind is FaultKind.LEASE_BLIP
    assert config.priorities()["stoker-worker"] == 10000
    assert config.priorities()["sim-background-critical"] == 1_000_000


@pytest.mark.parametrize(
    "data",
    [
        {"tick": 1},
        {"scheduler": {"bind_rate": "fast"}},
        {"node_pools": [{"instance_types": ["m9.galactic"]}]},
        {"node_pools": [{"budget_nodes": "ten"}]},
        {"background": {"archetypes": ["gpu-training-large"]}},
        {"faults": [{"at": 1, "kind": "meteor"}]},
        {"faults": [{"at": 1, "kind": "error", "op": "replace_pod"}]},
        {"node_pools": []},
    ],
)
def test_configuration_mistakes_name_the_key(data: dict[str, object]) -> None:
    """Unknown keys, wrong types and unknown names are ConfigErrors, never silent."""
    with pytest.raises(ConfigError):
        SimClusterConfig.from_mapping(data)


# -- the virtual-time loop ---------------------------------------------------------------------


def test_the_virtual_loop_jumps_to_each_timer_without_waiting() -> None:
    """A day of sleeps passes at once; timers fire at their exact due times, in order."""
    loop = vloop.new_event_loop(start=100.0)
    fired: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await asyncio.sleep(seconds)
        fired.append((name, loop.time()))

    async def main() -> None:
        await asyncio.gather(sleeper("day", 86_400), sleeper("tick", 0.5), sleeper("hour", 3600))

    started = time.perf_counter()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert time.perf_counter() - started < 5.0  # a real day would never finish
    assert fired == [("tick", 100.5), ("hour", 3700.0), ("day", 86_500.0)]


def test_the_virtual_loop_takes_callbacks_from_other_threads() -> None:
    """With nothing scheduled the loop waits for real I/O, so another thread can wake it."""
    loop = vloop.new_event_loop()

    async def main() -> float:
        done: asyncio.Future[float] = loop.create_future()
        threading.Thread(target=lambda: loop.call_soon_threadsafe(done.set_result, 42.0)).start()
        return await done

    try:
        assert loop.run_until_complete(main()) == 42.0
        assert loop.time() == 0.0
    finally:
        loop.close()


def test_a_callback_from_another_thread_lands_before_the_next_jump() -> None:
    """With a timer an hour away, a callback handed in from another thread runs at the
    time it came, not after the jump (the loop polls its pipe only when one came)."""
    loop = vloop.new_event_loop()

    async def main() -> tuple[float, float]:
        landed: asyncio.Future[float] = loop.create_future()
        later = asyncio.ensure_future(asyncio.sleep(3600))
        await asyncio.sleep(5)
        helper = threading.Thread(
            target=lambda: loop.call_soon_threadsafe(lambda: landed.set_result(loop.time()))
        )
        helper.start()
        helper.join()
        at = await landed
        await later
        return at, loop.time()

    try:
        assert loop.run_until_complete(main()) == (5.0, 3600.0)
    finally:
        loop.close()


def test_a_tick_runs_at_its_own_time_on_the_virtual_loop() -> None:
    """The loop reaches a tick through sums of floats that can fall one rounding step
    short; the timeline still reports the tick's exact time (a pass waiting for time to
    accrue once found itself due again in the same tick, forever)."""
    loop = vloop.new_event_loop(start=0.1)
    seen: list[float] = []

    async def main() -> None:
        timeline = Timeline(LoopClock(epoch=0), tick_s=0.5)
        timeline.start()
        for t in (0.7, 1234.3, 5000.05, 86_399.9):
            for _ in range(3):
                await asyncio.sleep(0.3)  # the clock wanders off the grid between ticks
            timeline.at(t, lambda: seen.append(timeline.now()))
        await asyncio.sleep(86_401)
        await timeline.stop()

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert seen == [1.0, 1234.5, 5000.5, 86_400.0]


def test_a_loop_clock_bound_to_a_loop_reads_that_loop() -> None:
    """The simulator binds its clock to the run's loop (no running-loop lookup per read)."""
    loop = vloop.new_event_loop(start=42.0)
    clock = LoopClock(epoch=1_000.0, loop=loop)
    try:
        assert clock.monotonic() == 42.0
        assert clock.now() == 1_000.0

        async def later() -> tuple[float, float]:
            await asyncio.sleep(8)
            return clock.monotonic(), clock.now()

        assert loop.run_until_complete(later()) == (50.0, 1_008.0)
    finally:
        loop.close()


def test_the_violation_log_keeps_the_histories_of_recent_subjects_only() -> None:
    """Every worker and claim of a run is a subject of its own history: a week's replay
    held millions (about a kilobyte each). The log keeps those noted lately; an older
    subject's trace has the recent events overall, and a subject noted again starts
    over."""
    from stoker.sim.invariants import ViolationLog

    t = [0.0]
    log = ViolationLog(lambda: t[0], subjects=100)
    for i in range(1_000):
        t[0] = float(i)
        log.note(f"event {i}", f"w-{i}", "org-a")
        assert log.histories() <= 200
    log.violation("I1", "w-999", "recent")
    log.violation("I2", "w-3", "long ago")
    recent, old = log.violations
    assert "t=999.0s event 999" in recent.trace
    # w-3's own events are forgotten; the recent ones overall are its trace.
    assert "t=3.0s event 3" not in old.trace and "t=999.0s event 999" in old.trace
    # A subject noted all along keeps its history.
    log.violation("I3", "org-a", "busy")
    assert log.violations[-1].trace[-1] == "t=999.0s event 999"
    assert len([line for line in log.violations[-1].trace if "event" in line]) >= 10
