"""Per-client views of the simulated API server: QPS budget, latency, scheduled faults.

Each control-plane replica gets its own `SimClient`, a `ClusterAPI` over the shared
`FakeApiServer`. A call goes through, in order:

1. the client's token bucket (client-go's flow control: `qps` tokens per second, at
   most `burst` saved; a caller that finds none reserves the next one and sleeps until
   it is due, so a burst proceeds at exactly the budget); time spent waiting is counted
   as throttling;
2. the latency drawn from the client's distribution (plus any `latency` fault);
3. the fault schedule: an `error`, `timeout`, `lease_blip` or `watch_drop` fault whose
   window covers this moment and that names this client (or any) and this operation
   (or any) fails the call instead of serving it.

Fault kinds (`FaultSpec`; `at` and `duration` in seconds after the cluster started):

- `error`: the call fails with the given HTTP `status` (500 by default), mapped to the
  port's errors as the real adapter maps them (`error_for_status`: 429 Throttled, 409
  Conflict, 410 Gone, 404, 400/422, 401/403, 5xx ClusterUnavailable);
- `timeout`: the call hangs `timeout_s` then fails with ClusterUnavailable; with
  `applied` the server did perform it (the response was lost: a create then conflicts);
- `lease_blip`: `create_lease` and `update_lease` fail (a lease-renewal blip of one
  replica, the outage of duckgres #820);
- `watch_drop`: at `at` the client's open watches end (the whole namespace's when no
  client is named), and new watches fail until the window closes;
- `latency`: `latency_s` more on every matching call during the window.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Coroutine, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NoReturn, TypeVar

from stoker.domain.errors import ConfigError
from stoker.ports.clock import Clock
from stoker.ports.cluster import (
    ClusterError,
    ClusterUnavailable,
    Lease,
    MetadataPatch,
    Pod,
    PodList,
    Selector,
    WatchEvent,
    error_for_status,
)
from stoker.sim.cluster.apiserver import FakeApiServer
from stoker.sim.cluster.calls import OPERATIONS
from stoker.sim.cluster.distributions import Distribution, distribution_from


class FaultKind(StrEnum):
    """What an injected fault does (see the module docstring)."""

    ERROR = "error"
    TIMEOUT = "timeout"
    LEASE_BLIP = "lease_blip"
    WATCH_DROP = "watch_drop"
    LATENCY = "latency"


_T = TypeVar("_T")

_LEASE_WRITES = frozenset({"create_lease", "update_lease"})


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """One scheduled fault: a kind, a window, and whom it hits."""

    at: float
    kind: FaultKind
    duration: float = 0.0
    client: str | None = None
    op: str | None = None
    status: int = 500
    timeout_s: float = 10.0
    applied: bool = False
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.at < 0 or self.duration < 0 or self.timeout_s < 0 or self.latency_s < 0:
            raise ConfigError(f"fault {self}: times must be >= 0")
        if self.op is not None and self.op not in OPERATIONS:
            raise ConfigError(f"fault op {self.op!r}: one of {sorted(OPERATIONS)}")

    @classmethod
    def from_mapping(cls, data: Mapping[str, object]) -> FaultSpec:
        """A fault from its YAML form `{at, duration, kind, client, op, ...}`."""
        known = {"at", "duration", "kind", "client", "op", "status", "timeout_s", "applied"}
        unknown = set(data) - known - {"latency_s"}
        if unknown:
            raise ConfigError(f"fault: unknown keys {sorted(unknown)}")
        try:
            kind = FaultKind(str(data["kind"]))
        except (KeyError, ValueError):
            raise ConfigError(
                f"fault: kind must be one of {[k.value for k in FaultKind]}"
            ) from None
        return cls(
            at=_float(data.get("at", 0.0)),
            kind=kind,
            duration=_float(data.get("duration", 0.0)),
            client=None if data.get("client") is None else str(data["client"]),
            op=None if data.get("op") is None else str(data["op"]),
            status=int(_float(data.get("status", 500))),
            timeout_s=_float(data.get("timeout_s", 10.0)),
            applied=bool(data.get("applied", False)),
            latency_s=_float(data.get("latency_s", 0.0)),
        )

    def hits(self, client: str, op: str) -> bool:
        """Whether the fault concerns `client` calling `op` (ignoring time)."""
        if self.client is not None and self.client != client:
            return False
        if self.kind is FaultKind.LEASE_BLIP:
            return op in _LEASE_WRITES
        if self.kind is FaultKind.WATCH_DROP:
            return op == "watch_pods"
        return self.op is None or self.op == op


def _float(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"fault: expected a number, got {value!r}")
    return float(value)


class FaultSchedule:
    """The faults of a run; windows count from `t0`, set when the cluster starts."""

    def __init__(self, faults: tuple[FaultSpec, ...]) -> None:
        self.faults = faults
        self.t0: float | None = None

    def active(self, client: str, op: str, now: float) -> list[FaultSpec]:
        """Faults whose window covers `now` and that hit `client` calling `op`."""
        if self.t0 is None or not self.faults:
            return []
        t = now - self.t0
        return [
            fault
            for fault in self.faults
            if fault.at <= t < fault.at + max(fault.duration, 1e-9) and fault.hits(client, op)
        ]


@dataclass(slots=True)
class ClientStats:
    """One client's API usage."""

    calls: Counter[str]
    throttled_calls: int = 0
    throttle_wait_s: float = 0.0
    faults_injected: int = 0


class TokenBucket:
    """client-go's rate limiter: reserve a token now, sleep until it is due."""

    def __init__(self, qps: float, burst: int) -> None:
        if qps <= 0 or burst < 1:
            raise ValueError("a token bucket needs qps > 0 and burst >= 1")
        self.qps = qps
        self.burst = burst
        self._tokens = float(burst)
        self._stamp: float | None = None

    def reserve(self, now: float) -> float:
        """Take a token (possibly one not yet accrued); the seconds to wait before using it."""
        if self._stamp is not None:
            self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.qps)
        self._stamp = now
        self._tokens -= 1.0
        return 0.0 if self._tokens >= 0 else -self._tokens / self.qps


class SimClient:
    """A ClusterAPI handle of one client (a control-plane replica) on the simulated cluster."""

    def __init__(
        self,
        *,
        name: str,
        server: FakeApiServer,
        clock: Clock,
        rng: random.Random,
        qps: float,
        burst: int,
        latency: Distribution | None,
        faults: FaultSchedule,
        stats: ClientStats,
    ) -> None:
        self.name = name
        self._server = server
        self._clock = clock
        self._rng = rng
        self._bucket = TokenBucket(qps, burst)
        self._latency = latency
        self._faults = faults
        self.stats = stats
        self._closed = False

    @property
    def namespace(self) -> str:
        """The namespace every call acts in."""
        return self._server.namespace

    async def create_pod(self, pod: Pod) -> Pod:
        """As `ClusterAPI.create_pod`, through this client's budget, latency and faults."""
        return await self._call("create_pod", lambda: self._server.create_pod(pod))

    async def delete_pod(self, name: str, grace_s: float | None = None) -> None:
        """As `ClusterAPI.delete_pod`."""
        await self._call("delete_pod", lambda: self._server.delete_pod(name, grace_s))

    async def patch_pod(
        self, name: str, labels: MetadataPatch = None, annotations: MetadataPatch = None
    ) -> Pod:
        """As `ClusterAPI.patch_pod`."""
        return await self._call(
            "patch_pod", lambda: self._server.patch_pod(name, labels, annotations)
        )

    async def get_pod(self, name: str) -> Pod | None:
        """As `ClusterAPI.get_pod`."""
        return await self._call("get_pod", lambda: self._server.get_pod(name))

    async def list_pods(self, selector: Selector) -> PodList:
        """As `ClusterAPI.list_pods`."""
        return await self._call("list_pods", lambda: self._server.list_pods(selector))

    def watch_pods(
        self, selector: Selector, resource_version: str
    ) -> AsyncGenerator[WatchEvent, None]:
        """As `ClusterAPI.watch_pods`; a `watch_drop` fault ends it."""
        return self._watch(selector, resource_version)

    async def get_lease(self, name: str) -> Lease | None:
        """As `ClusterAPI.get_lease`."""
        return await self._call("get_lease", lambda: self._server.get_lease(name))

    async def create_lease(self, lease: Lease) -> Lease:
        """As `ClusterAPI.create_lease`."""
        return await self._call("create_lease", lambda: self._server.create_lease(lease))

    async def update_lease(self, lease: Lease) -> Lease:
        """As `ClusterAPI.update_lease`."""
        return await self._call("update_lease", lambda: self._server.update_lease(lease))

    async def close(self) -> None:
        """End this client's watches; later calls fail (the shared server stays up)."""
        self._closed = True
        self._server.drop_watches(owner=self.name)

    async def _watch(
        self, selector: Selector, resource_version: str
    ) -> AsyncGenerator[WatchEvent, None]:
        fault = await self._enter("watch_pods")
        if fault is not None:
            raise self._error(fault, "watch_pods")
        stream = self._server.open_watch(selector, resource_version, owner=self.name)
        try:
            async for event in stream:
                yield event
        finally:
            await stream.aclose()

    async def _call(self, op: str, call: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
        """Serve `call()` through the budget, latency and faults of operation `op`."""
        fault = await self._enter(op)
        served = call()
        if fault is not None:
            await self._fail(fault, op, served)
        return await served

    async def _enter(self, op: str) -> FaultSpec | None:
        """Count the call, wait for a token and the latency; the fault to apply, if any."""
        if self._closed:
            raise ClusterError(f"client {self.name!r} is closed")
        self.stats.calls[op] += 1
        wait = self._bucket.reserve(self._clock.monotonic())
        if wait > 0:
            self.stats.throttled_calls += 1
            self.stats.throttle_wait_s += wait
            await self._clock.sleep(wait)
        active = self._faults.active(self.name, op, self._clock.monotonic())
        delay = self._latency.sample(self._rng) if self._latency is not None else 0.0
        delay += sum(fault.latency_s for fault in active if fault.kind is FaultKind.LATENCY)
        if delay > 0:
            await self._clock.sleep(delay)
            active = self._faults.active(self.name, op, self._clock.monotonic())
        for fault in active:
            if fault.kind is not FaultKind.LATENCY:
                self.stats.faults_injected += 1
                return fault
        return None

    async def _fail(self, fault: FaultSpec, op: str, call: Coroutine[Any, Any, Any]) -> NoReturn:
        """Fail a call that a fault hits; `call` runs only for a timeout that `applied`."""
        if fault.kind is FaultKind.TIMEOUT:
            if fault.applied:
                try:
                    await call
                except ClusterError:
                    pass  # the caller sees the timeout either way
            else:
                call.close()
            await self._clock.sleep(fault.timeout_s)
        else:
            call.close()
        raise self._error(fault, op)

    def _error(self, fault: FaultSpec, op: str) -> ClusterError:
        what = f"{op} by {self.name} (injected {fault.kind.value})"
        if fault.kind is FaultKind.TIMEOUT:
            return ClusterUnavailable(f"{what}: timed out after {fault.timeout_s} s")
        if fault.kind is FaultKind.LEASE_BLIP:
            return ClusterUnavailable(f"{what}: lease renewal failed", status=503)
        if fault.kind is FaultKind.WATCH_DROP:
            return ClusterUnavailable(f"{what}: watch refused", status=503)
        return error_for_status(fault.status, f"{what}: HTTP {fault.status}", retry_after=1.0)


def latency_from(spec: object) -> Distribution | None:
    """A latency distribution from config (None or 0 means no latency)."""
    if spec is None:
        return None
    distribution = distribution_from(spec, what="latency")
    return None if distribution.mean == 0 else distribution
