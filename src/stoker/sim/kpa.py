"""The `knative-kpa` baseline: Knative's Pod Autoscaler deciding the warm pool.

The algorithm is Knative Serving's KPA as documented
(https://knative.dev/docs/serving/autoscaling/kpa-specific/ and the `config-autoscaler`
ConfigMap), with a session as a request and a worker as a pod of `containerConcurrency: 1`:

- concurrency (sessions holding or waiting for a worker: what queue-proxy and the
  activator report) is sampled every second (the autoscaler's scrape interval) and
  averaged over a stable window (`stable-window`, 60 s) and a panic window
  (`panic-window-percentage` 10 % of it, 6 s);
- desired pods = ceil(average / (target x utilization)), target 1 per pod and
  `container-concurrency-target-percentage` 70 %;
- panic mode starts when the panic window's desired pods reach `panic-threshold-percentage`
  200 % of the ready pods; in panic the larger of both windows wins and the pod count
  never goes down; panic ends when the threshold has not been crossed for a stable window.

Stoker's janitor keeps the pool at `warm_target + demand`; the KPA's demand is its desired
pods minus the workers in use (bound or being bound) minus `warm_target`, so the pool's
warm workers are the KPA's spare pods and `warm_target` is a floor (a `min-scale` of
spare capacity). Everything else (claims, spawns, headroom, reaping) is stoker's.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable

from stoker.domain.states import WorkerState
from stoker.ports.store import Store
from stoker.sim.scenario import KnativeKpaParams

#: Worker states that hold a session or are being bound to one (Knative's in-use pods).
_IN_USE = (WorkerState.RESERVED, WorkerState.ACTIVATING, WorkerState.HOT)
#: Worker states of a pod that is Ready (Knative's ready pods): in use, parked or warm.
_READY = (*_IN_USE, WorkerState.HOT_IDLE, WorkerState.WARM)


class KnativeKpa:
    """A KPA for one pool: `run()` samples, and calling it is the janitor's demand source."""

    def __init__(self, params: KnativeKpaParams, *, store: Store, warm_target: int) -> None:
        self._params = params
        self._store = store
        self._warm_target = warm_target
        self._probe: Callable[[], int] = lambda: 0
        self._samples: deque[tuple[float, int]] = deque()
        self._panic_since: float | None = None
        self._max_panic_pods = 0
        #: The last decision, for tests and the report: desired pods, and whether in panic.
        self.desired_pods = 0
        self.panicking = False

    def observe(self, probe: Callable[[], int]) -> None:
        """Where concurrency comes from (the load driver's sessions holding or waiting)."""
        self._probe = probe

    async def run(self, now: Callable[[], float]) -> None:
        """Sample concurrency every `scrape_s` until cancelled."""
        while True:
            await asyncio.sleep(self._params.scrape_s)
            self.sample(now(), self._probe())

    def sample(self, t: float, concurrency: int) -> None:
        """Add one concurrency sample; drop those older than the stable window."""
        self._samples.append((t, concurrency))
        while self._samples and self._samples[0][0] <= t - self._params.stable_window_s:
            self._samples.popleft()

    def desired(self, now: float, ready: int) -> int:
        """The KPA's desired pod count at `now` with `ready` pods Ready."""
        p = self._params
        per_pod = p.target * p.target_utilization
        panic_window = p.stable_window_s * p.panic_window_percentage / 100
        stable = self._average(now, p.stable_window_s)
        panic = self._average(now, panic_window)
        stable_pods = math.ceil(stable / per_pod - 1e-9)
        panic_pods = math.ceil(panic / per_pod - 1e-9)
        over = panic_pods / max(1, ready) >= p.panic_threshold_percentage / 100
        if over:
            self._panic_since = now
        elif self._panic_since is not None and now - self._panic_since >= p.stable_window_s:
            self._panic_since = None
            self._max_panic_pods = 0
        desired = stable_pods
        if self._panic_since is not None:
            desired = max(desired, panic_pods, self._max_panic_pods)
            self._max_panic_pods = desired
        self.desired_pods, self.panicking = desired, self._panic_since is not None
        return desired

    def _average(self, now: float, window: float) -> float:
        values = [c for t, c in self._samples if t > now - window]
        return sum(values) / len(values) if values else 0.0

    async def __call__(self, pool: str, now: float) -> int:
        """The janitor's demand: desired pods beyond those in use and the warm target."""
        in_use = ready = 0
        for count in await self._store.count_workers():
            if count.pool != pool:
                continue
            if count.state in _IN_USE or (count.state is WorkerState.SPAWNING and count.bound):
                in_use += count.count
            if count.state in _READY:
                ready += count.count
        # The janitor's clock is the wall clock; the samples are on the run's clock.
        desired = self.desired(self._samples[-1][0] if self._samples else 0.0, ready)
        return max(0, desired - in_use - self._warm_target)
