"""Lease electors: the shared loop on an in-memory lease, and the Kubernetes Lease backend.

Every test runs on looptime's virtual clock and asserts virtual timings: "takes over after
the lease duration" is checked against the loop time of the last successful renewal, never
by sleeping and hoping. No Kubernetes cluster can run where these tests run; the
in-process `FakeApiServer` (which keeps the API server's resourceVersion compare-and-set)
stands in for one.
"""

# These tests assert a property, act, then assert it changed: mypy narrows the first
# assert onto the second and calls what follows unreachable.
# mypy: disable-error-code="unreachable"

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field, replace

import pytest
from looptime import LoopTimeProxy

from stoker.adapters._election import LeaseElector
from stoker.adapters.elector_k8s import KubernetesLeaseBackend, KubernetesLeaseElector
from stoker.domain.errors import StoreError
from stoker.ports.clock import Clock, LoopClock, VirtualClock
from stoker.ports.cluster import (
    ClusterUnavailable,
    Lease,
    Pod,
    PodList,
    Selector,
    WatchEvent,
)
from stoker.ports.elector import Elector
from stoker.sim.cluster import FakeApiServer

pytestmark = pytest.mark.looptime

EPOCH = 1_700_000_000.0
#: client-go's conventional timings, the electors' defaults.
LEASE, DEADLINE, RETRY = 15.0, 10.0, 2.0


@dataclass
class MemoryLeaseBackend:
    """One lease in memory with the store lease's rules; calls of chosen holders fail or hang.

    Successful calls are logged with the loop time they started at, so a test knows when
    a holder last renewed.
    """

    holder: str = ""
    epoch: int = 0
    renewed_at: float = 0.0
    duration_s: float = 0.0
    failing: set[str] = field(default_factory=set)
    hanging: set[str] = field(default_factory=set)
    renewals: list[tuple[str, float]] = field(default_factory=list)

    async def try_acquire(self, holder: str, now: float, duration_s: float) -> int | None:
        started = asyncio.get_running_loop().time()
        await asyncio.sleep(0)
        if holder in self.hanging:
            await asyncio.Event().wait()
        if holder in self.failing:
            raise StoreError(f"injected failure for {holder}")
        expired = now >= self.renewed_at + self.duration_s
        if self.holder and self.holder != holder and not expired:
            return None
        if self.holder != holder or expired:
            self.epoch += 1
        self.holder, self.renewed_at, self.duration_s = holder, now, duration_s
        self.renewals.append((holder, started))
        return self.epoch

    async def release(self, holder: str, now: float) -> None:
        if holder in self.failing:
            raise StoreError(f"injected failure for {holder}")
        if self.holder == holder:
            self.holder = ""

    def last_renewal(self, holder: str) -> float:
        return max(t for h, t in self.renewals if h == holder)


@dataclass
class Transitions:
    """What the callbacks reported, with the loop time of each report."""

    events: list[tuple[str, str, int, float]] = field(default_factory=list)

    def hooks(self, identity: str) -> tuple[Callable[[int], None], Callable[[], None]]:
        def started(epoch: int) -> None:
            self.events.append(("started", identity, epoch, asyncio.get_running_loop().time()))

        def stopped() -> None:
            self.events.append(("stopped", identity, 0, asyncio.get_running_loop().time()))

        return started, stopped

    def times(self, kind: str, identity: str) -> list[float]:
        return [t for k, who, _, t in self.events if (k, who) == (kind, identity)]


def elector(
    backend: MemoryLeaseBackend,
    identity: str,
    *,
    clock: Clock | None = None,
    transitions: Transitions | None = None,
) -> LeaseElector:
    started, stopped = (transitions or Transitions()).hooks(identity)
    return LeaseElector(
        backend,
        clock=clock or LoopClock(epoch=EPOCH),
        identity=identity,
        on_started_leading=started,
        on_stopped_leading=stopped,
    )


async def until(check: Callable[[], bool], *, within: float, step: float = 0.05) -> float:
    """Loop time at which `check` first holds; fails if it does not within `within` s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {within}s")
        await asyncio.sleep(step)
    return loop.time()


async def stop(*tasks: asyncio.Task[None]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# -- construction --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lease", "deadline", "retry", "message"),
    [
        (10, 10, 2, r"lease_duration_s \(10\) must exceed renew_deadline_s \(10\)"),
        (15, 10, 9, r"renew_deadline_s \(10\) must exceed 1.2 x retry_period_s \(9\)"),
        (15, 10, 0, r"retry_period_s \(0\) must be > 0"),
        (15, 2.4, 2, r"renew_deadline_s \(2.4\) must exceed 1.2 x retry_period_s \(2\)"),
    ],
)
async def test_timings_are_validated(
    lease: float, deadline: float, retry: float, message: str
) -> None:
    """lease duration > renew deadline > 1.2 x retry period > 0, as client-go requires."""
    with pytest.raises(ValueError, match=message):
        LeaseElector(
            MemoryLeaseBackend(),
            clock=LoopClock(),
            identity="a",
            lease_duration_s=lease,
            renew_deadline_s=deadline,
            retry_period_s=retry,
        )


async def test_the_elector_implements_the_port() -> None:
    """A LeaseElector and the Kubernetes one are Electors with client-go's default timings."""
    electors: list[Elector] = [
        LeaseElector(MemoryLeaseBackend(), clock=LoopClock(), identity="a"),
        KubernetesLeaseElector(
            cluster=FakeApiServer(clock=LoopClock()), clock=LoopClock(), identity="b"
        ),
    ]
    for one in electors:
        assert not one.is_leader and one.epoch == 0
    assert isinstance(electors[1], LeaseElector)
    assert (electors[1].lease_duration_s, electors[1].renew_deadline_s) == (LEASE, DEADLINE)
    assert electors[1].retry_period_s == RETRY


# -- the shared loop on an in-memory lease --------------------------------------------------


async def test_two_electors_exactly_one_leads() -> None:
    """Sampled every virtual second for a minute: always exactly one leader, the same one."""
    backend, clock = MemoryLeaseBackend(), LoopClock(epoch=EPOCH)
    a, b = elector(backend, "a", clock=clock), elector(backend, "b", clock=clock)
    tasks = [asyncio.create_task(e.run()) for e in (a, b)]
    try:
        leaders = []
        for _ in range(60):
            await asyncio.sleep(1)
            leaders.append(tuple(e.identity for e in (a, b) if e.is_leader))
        assert set(leaders) == {("a",)}
        assert a.epoch == 1 and a.terms == 1
    finally:
        await stop(*tasks)


async def test_failed_renewals_hand_the_lease_over_after_its_duration(
    looptime: LoopTimeProxy,
) -> None:
    """The holder steps down at its renew deadline; the other takes over once the lease
    expired (its duration after the last renewal); the first re-contends and leads again."""
    backend, clock = MemoryLeaseBackend(), LoopClock(epoch=EPOCH)
    transitions = Transitions()
    a = elector(backend, "a", clock=clock, transitions=transitions)
    b = elector(backend, "b", clock=clock, transitions=transitions)
    task_a = asyncio.create_task(a.run())
    await asyncio.sleep(0.5)
    task_b = asyncio.create_task(b.run())
    try:
        await asyncio.sleep(7)
        assert a.is_leader and not b.is_leader
        backend.failing.add("a")
        last = backend.last_renewal("a")

        took_over = await until(lambda: b.is_leader, within=60)
        (stepped_down,) = transitions.times("stopped", "a")
        assert stepped_down == pytest.approx(last + DEADLINE)
        assert last + LEASE <= took_over <= last + LEASE + RETRY
        assert not a.is_leader
        assert (a.epoch, b.epoch) == (1, 2)

        # a keeps contending through its own failures and the other's term.
        await asyncio.sleep(30)
        assert not task_a.done() and a.failures >= 10
        backend.failing.discard("a")
        await b.resign()
        resigned_at = float(looptime)
        back = await until(lambda: a.is_leader, within=10)
        assert back - resigned_at <= RETRY
        assert a.epoch == 3 and a.terms == 2
        # Resigned: b's run() returns at its next wake-up instead of contending again.
        await until(task_b.done, within=RETRY + 0.1)
        assert task_b.exception() is None
    finally:
        await stop(task_a, task_b)


async def test_a_hung_renewal_steps_down_on_time() -> None:
    """A renewal that never answers does not keep the leader leading past its deadline."""
    backend = MemoryLeaseBackend()
    transitions = Transitions()
    a = elector(backend, "a", transitions=transitions)
    task = asyncio.create_task(a.run())
    try:
        await asyncio.sleep(5)
        backend.hanging.add("a")
        last = backend.last_renewal("a")
        await until(lambda: bool(transitions.times("stopped", "a")), within=30)
        (stepped_down,) = transitions.times("stopped", "a")
        assert stepped_down == pytest.approx(last + DEADLINE)
        backend.hanging.discard("a")
        await until(lambda: a.is_leader, within=30)
        assert not task.done()
    finally:
        await stop(task)


async def test_a_stalled_leader_stops_claiming_leadership_at_once() -> None:
    """is_leader reads the clock: with no loop iteration at all it turns False at the deadline."""
    clock = VirtualClock(epoch=EPOCH)
    a = elector(MemoryLeaseBackend(), "a", clock=clock)
    task = asyncio.create_task(a.run())
    try:
        await asyncio.sleep(3)
        assert a.is_leader
        clock.advance(DEADLINE)  # time jumps; the elector's task has not run since
        assert not a.is_leader
        # Once the loop runs again it steps down, contends, and leads a new term.
        await until(lambda: a.is_leader, within=RETRY + 1)
        assert a.terms == 2
    finally:
        await stop(task)


async def test_backend_errors_never_end_the_loop(looptime: LoopTimeProxy) -> None:
    """An elector that cannot reach its backend keeps contending and leads once it can."""
    backend = MemoryLeaseBackend(failing={"a"})
    a = elector(backend, "a")
    task = asyncio.create_task(a.run())
    try:
        await asyncio.sleep(60)
        assert not task.done() and not a.is_leader
        assert a.failures == pytest.approx(60 / RETRY, abs=1)
        backend.failing.clear()
        healed = float(looptime)
        led = await until(lambda: a.is_leader, within=10)
        assert led - healed <= RETRY
    finally:
        await stop(task)


async def test_losing_the_lease_to_another_holder_steps_down_at_once() -> None:
    """A renewal that finds another holder ends the term at that renewal."""
    backend = MemoryLeaseBackend()
    transitions = Transitions()
    a = elector(backend, "a", transitions=transitions)
    task = asyncio.create_task(a.run())
    try:
        await asyncio.sleep(1)
        backend.holder, backend.epoch = "intruder", backend.epoch + 1
        backend.renewed_at = EPOCH + 10_000  # far in the future: not expired
        stepped = await until(lambda: not a.is_leader, within=5)
        assert stepped <= 1 + RETRY
        assert transitions.times("stopped", "a") == [pytest.approx(stepped, abs=0.05)]
        await asyncio.sleep(10)
        assert not task.done()
    finally:
        await stop(task)


async def test_cancelling_run_steps_down_without_releasing() -> None:
    """Cancellation ends the term locally; the lease is left to expire (resign frees it)."""
    backend = MemoryLeaseBackend()
    transitions = Transitions()
    a = elector(backend, "a", transitions=transitions)
    task = asyncio.create_task(a.run())
    await asyncio.sleep(1)
    await stop(task)
    assert not a.is_leader
    assert [k for k, *_ in transitions.events] == ["started", "stopped"]
    assert backend.holder == "a"
    await a.resign()
    assert backend.holder == ""


async def test_a_failing_callback_does_not_stop_the_elector() -> None:
    """Callbacks are hooks for metrics: an exception in one is logged, never fatal."""

    def explode(epoch: int) -> None:
        raise RuntimeError(f"broken hook at {epoch}")

    a = LeaseElector(
        MemoryLeaseBackend(), clock=LoopClock(), identity="a", on_started_leading=explode
    )
    task = asyncio.create_task(a.run())
    try:
        await asyncio.sleep(5)
        assert a.is_leader and not task.done()
    finally:
        await stop(task)


# -- the Kubernetes Lease backend -----------------------------------------------------------


class LeaseCalls:
    """A ClusterAPI in front of the fake whose Lease calls fail while `failing` is set.

    Each elector gets its own, so one replica can lose the API server while the others
    keep it (a network partition of one replica).
    """

    def __init__(self, server: FakeApiServer) -> None:
        self.server = server
        self.failing = False
        self.calls: collections.Counter[str] = collections.Counter()

    @property
    def namespace(self) -> str:
        return self.server.namespace

    def _check(self) -> None:
        if self.failing:
            raise ClusterUnavailable("injected: the API server is unreachable")

    async def get_lease(self, name: str) -> Lease | None:
        self.calls["get"] += 1
        self._check()
        return await self.server.get_lease(name)

    async def create_lease(self, lease: Lease) -> Lease:
        self.calls["create"] += 1
        self._check()
        return await self.server.create_lease(lease)

    async def update_lease(self, lease: Lease) -> Lease:
        self.calls["update"] += 1
        self._check()
        return await self.server.update_lease(lease)

    async def create_pod(self, pod: Pod) -> Pod:
        return await self.server.create_pod(pod)

    async def delete_pod(self, name: str, grace_s: float | None = None) -> None:
        await self.server.delete_pod(name, grace_s)

    async def patch_pod(
        self,
        name: str,
        labels: Mapping[str, str | None] | None = None,
        annotations: Mapping[str, str | None] | None = None,
    ) -> Pod:
        return await self.server.patch_pod(name, labels, annotations)

    async def get_pod(self, name: str) -> Pod | None:
        return await self.server.get_pod(name)

    async def list_pods(self, selector: Selector) -> PodList:
        return await self.server.list_pods(selector)

    def watch_pods(
        self, selector: Selector, resource_version: str
    ) -> AsyncGenerator[WatchEvent, None]:
        return self.server.watch_pods(selector, resource_version)

    async def close(self) -> None:
        await self.server.close()


def k8s_elector(
    cluster: LeaseCalls | FakeApiServer,
    identity: str,
    clock: Clock,
    transitions: Transitions | None = None,
) -> KubernetesLeaseElector:
    started, stopped = (transitions or Transitions()).hooks(identity)
    return KubernetesLeaseElector(
        cluster=cluster,
        clock=clock,
        identity=identity,
        on_started_leading=started,
        on_stopped_leading=stopped,
    )


async def lease_of(server: FakeApiServer) -> Lease:
    lease = await server.get_lease("stoker-janitor")
    assert lease is not None
    return lease


async def test_two_kubernetes_electors_on_one_lease(looptime: LoopTimeProxy) -> None:
    """Exactly one leads; the Lease names it, with client-go's fields, renewed every retry."""
    clock = LoopClock(epoch=EPOCH)
    server = FakeApiServer(clock=clock, namespace="stoker")
    a, b = k8s_elector(server, "cp-a", clock), k8s_elector(server, "cp-b", clock)
    tasks = [asyncio.create_task(e.run()) for e in (a, b)]
    try:
        for _ in range(30):
            await asyncio.sleep(1)
            assert [e.identity for e in (a, b) if e.is_leader] == ["cp-a"]
        lease = await lease_of(server)
        assert lease.holder == "cp-a"
        assert lease.duration_s == 15
        assert lease.transitions == 0 and a.epoch == 1
        assert lease.acquire_time == pytest.approx(EPOCH)
        assert EPOCH + float(looptime) - lease.renew_time <= RETRY  # type: ignore[operator]
    finally:
        await stop(*tasks)
        await server.close()


async def test_the_kubernetes_holder_renews_with_one_call_and_rereads_after_a_conflict(
    looptime: LoopTimeProxy,
) -> None:
    """The holder renews on the Lease it last wrote (an update, no get); the contender
    only reads. When someone else writes the Lease, the holder's update conflicts: it
    reads the Lease, sees the other holder and steps down."""
    clock = LoopClock(epoch=EPOCH)
    server = FakeApiServer(clock=clock, namespace="stoker")
    to_a, to_b = LeaseCalls(server), LeaseCalls(server)
    a, b = k8s_elector(to_a, "cp-a", clock), k8s_elector(to_b, "cp-b", clock)
    task_a = asyncio.create_task(a.run())
    await asyncio.sleep(0.5)
    task_b = asyncio.create_task(b.run())
    try:
        await asyncio.sleep(1)
        assert a.is_leader
        before = dict(to_a.calls)
        await asyncio.sleep(10 * RETRY)
        renewals = to_a.calls["update"] - before.get("update", 0)
        assert renewals >= 9
        assert to_a.calls["get"] == before.get("get", 0)
        assert to_b.calls["update"] == 0 and to_b.calls["get"] >= 9
        taken = replace(await lease_of(server), holder="cp-z", transitions=5)
        await server.update_lease(taken)
        await asyncio.sleep(RETRY + 0.5)
        assert not a.is_leader
        assert to_a.calls["get"] > before.get("get", 0)
    finally:
        await stop(task_a, task_b)
        await server.close()


async def test_a_partitioned_kubernetes_leader_is_replaced_after_the_lease_duration(
    looptime: LoopTimeProxy,
) -> None:
    """The holder cannot reach the API server: it steps down at its renew deadline, the
    other replica takes the Lease once it saw it unchanged for the lease duration, with
    leaseTransitions bumped; the first keeps contending and leads again later."""
    clock = LoopClock(epoch=EPOCH)
    server = FakeApiServer(clock=clock, namespace="stoker")
    to_a, to_b = LeaseCalls(server), LeaseCalls(server)
    transitions = Transitions()
    a = k8s_elector(to_a, "cp-a", clock, transitions)
    b = k8s_elector(to_b, "cp-b", clock, transitions)
    task_a = asyncio.create_task(a.run())
    await asyncio.sleep(0.5)
    task_b = asyncio.create_task(b.run())
    try:
        await asyncio.sleep(9)
        assert a.is_leader
        renewed = await lease_of(server)
        last = renewed.renew_time - EPOCH  # type: ignore[operator]
        to_a.failing = True

        took_over = await until(lambda: b.is_leader, within=60)
        assert transitions.times("stopped", "cp-a") == [pytest.approx(last + DEADLINE)]
        # b saw the last renewal on its next poll, then waited a whole lease duration.
        assert last + LEASE <= took_over <= last + LEASE + 2 * RETRY
        lease = await lease_of(server)
        assert (lease.holder, lease.transitions, b.epoch) == ("cp-b", 1, 2)

        await asyncio.sleep(20)
        assert not task_a.done() and not a.is_leader
        to_a.failing = False
        await b.resign()
        assert (await lease_of(server)).holder is None
        resigned_at = float(looptime)
        back = await until(lambda: a.is_leader, within=10)
        assert back - resigned_at <= RETRY
        lease = await lease_of(server)
        assert (lease.holder, lease.transitions, a.epoch) == ("cp-a", 2, 3)
    finally:
        await stop(task_a, task_b)
        await server.close()


async def test_a_conflict_is_a_lost_race_not_an_error() -> None:
    """Two replicas creating (then updating) the Lease at once: one wins, the other gets None."""
    server = FakeApiServer(clock=LoopClock(epoch=EPOCH), namespace="stoker")
    # Every call takes 0.1 s, so both replicas read before either one's write lands.
    server.set_latency(0.1)
    first, second = KubernetesLeaseBackend(server), KubernetesLeaseBackend(server)
    created = await asyncio.gather(
        first.try_acquire("cp-a", EPOCH, LEASE), second.try_acquire("cp-b", EPOCH, LEASE)
    )
    assert sorted(created, key=str) == [1, None]
    assert server.calls["create_lease"] == 2  # the loser's create was a 409, not an error
    holder = (await lease_of(server)).holder
    await (first if holder == "cp-a" else second).release(holder or "", EPOCH + 1)
    assert (await lease_of(server)).holder is None

    taken = await asyncio.gather(
        first.try_acquire("cp-a", EPOCH + 2, LEASE), second.try_acquire("cp-b", EPOCH + 2, LEASE)
    )
    assert sorted(taken, key=str) == [2, None]
    assert server.calls["update_lease"] == 3  # the release and both takeovers; one lost
    await server.close()


async def test_release_leaves_a_lease_held_by_someone_else_alone() -> None:
    """A replica releases only its own lease, and a renewal keeps the acquire time."""
    server = FakeApiServer(clock=LoopClock(epoch=EPOCH), namespace="stoker")
    backend = KubernetesLeaseBackend(server)
    assert await backend.try_acquire("cp-a", EPOCH, LEASE) == 1
    assert await backend.try_acquire("cp-a", EPOCH + 2, LEASE) == 1
    await backend.release("cp-b", EPOCH + 3)
    lease = await lease_of(server)
    assert (lease.holder, lease.acquire_time, lease.renew_time) == ("cp-a", EPOCH, EPOCH + 2)
    await server.close()


async def test_kubernetes_electors_run_through_api_errors() -> None:
    """5xx from the API server while contending: the elector keeps going and leads later."""
    clock = LoopClock(epoch=EPOCH)
    server = FakeApiServer(clock=clock, namespace="stoker")
    server.fail_next("get_lease", ClusterUnavailable("etcd leader change"), times=5)
    a = k8s_elector(server, "cp-a", clock)
    task = asyncio.create_task(a.run())
    try:
        led = await until(lambda: a.is_leader, within=30)
        assert led == pytest.approx(5 * RETRY, abs=0.1)
        assert a.failures == 5
    finally:
        await stop(task)
        await server.close()
