"""The simulated kubelets: pull images, start containers, report Running/Ready, stop pods.

After a pod is bound, its node pulls each image it does not have yet (serially, the
kubelet's default `serializeImagePulls: true`; a pull in progress is shared by every pod
that needs the image), then starts the containers; the pod becomes Running, and Ready
after `ready_delay` (the first successful readiness probe). All of it reaches watchers
as MODIFIED events. A graceful deletion completes when the containers have stopped:
after the drawn `shutdown` time, or at the end of the grace period if that comes first.

Defaults and where they come from:

- `container_start` uniform 3-5 s: duckgres #761 measured "3-5 s to spawn on an
  existing node" (image cached, process start and first health check);
- `image_pull` log-normal, median 10 s (p99 ~32 s, capped at 300 s): a few hundred MB
  at registry throughput; an assumption, as no source in the research measured it;
  pause images (`registry.k8s.io/pause`, placeholders) take 1 s;
- `ready_delay` 0 s: the start distribution already ends at the first passing probe;
- `shutdown` uniform 1-3 s: a process that handles SIGTERM exits within seconds
  (an assumption); one that ignores it is killed when the grace period ends;
- `start_limit` none: each pod starts on its own. A number stands for one machine's
  start-up slots (the local runtime's `runtime.start_limit`, a backtest of a local pool):
  at most that many containers of the whole cluster start at once; the others wait in
  arrival order. A start holds its slot for `start_hold_s` (the local runtime's measured
  mean: a start-up that waits rather than computes gives its slot on), or for all of its
  `container_start` when that is shorter or `start_hold_s` is none.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial

from stoker.ports.cluster import PodPhase
from stoker.sim.cluster.distributions import Constant, Distribution, LogNormal, Uniform
from stoker.sim.cluster.model import SimNode, SimPod
from stoker.sim.cluster.timeline import Timeline


def _default_pulls_by_image() -> Mapping[str, Distribution]:
    return {"registry.k8s.io/pause": Constant(1.0), "pause:": Constant(1.0)}


@dataclass(frozen=True)
class KubeletConfig:
    """Delays of the kubelets; see the module docstring for the defaults' sources.

    `image_pull_by_image` maps an image *prefix* to its pull time (the longest matching
    prefix wins), for images much smaller or larger than the rest.
    """

    image_pull: Distribution = field(default_factory=lambda: LogNormal(10.0, 0.5, cap=300.0))
    image_pull_by_image: Mapping[str, Distribution] = field(default_factory=_default_pulls_by_image)
    container_start: Distribution = field(default_factory=lambda: Uniform(3.0, 5.0))
    ready_delay: Distribution = field(default_factory=lambda: Constant(0.0))
    shutdown: Distribution = field(default_factory=lambda: Uniform(1.0, 3.0))
    serialize_image_pulls: bool = True
    #: Containers of the whole cluster starting at once at most (None: no bound), and
    #: how long a start holds its slot at most (None: all of its start).
    start_limit: int | None = None
    start_hold_s: float | None = None

    def __post_init__(self) -> None:
        if self.start_limit is not None and self.start_limit < 1:
            raise ValueError(f"start_limit must be at least 1, got {self.start_limit}")
        if self.start_hold_s is not None and not self.start_hold_s >= 0:
            raise ValueError(f"start_hold_s must be at least 0, got {self.start_hold_s}")


@dataclass(slots=True)
class KubeletCounters:
    """What the kubelets did, for the cluster snapshot."""

    image_pulls: int = 0
    pods_started: int = 0


class Kubelet:
    """All nodes' kubelets in one object: the cluster calls it on binds and deletions."""

    def __init__(self, *, config: KubeletConfig, timeline: Timeline, rng: random.Random) -> None:
        self.config = config
        self.counters = KubeletCounters()
        self._timeline = timeline
        self._rng = rng
        self._pull_times: dict[str, Distribution] = {}
        #: With a `start_limit`: the pods holding a start-up slot, and those waiting for one.
        #: (pod -> when it gives its slot on, exactly), and (pod, node, since when).
        self._starting: dict[SimPod, float] = {}
        self._queued: deque[tuple[SimPod, SimNode, float]] = deque()

    def pull_time(self, image: str) -> Distribution:
        """How long pulling `image` takes (the longest matching prefix of the overrides)."""
        known = self._pull_times.get(image)
        if known is None:
            matches = [p for p in self.config.image_pull_by_image if image.startswith(p)]
            if matches:
                known = self.config.image_pull_by_image[max(matches, key=len)]
            else:
                known = self.config.image_pull
            self._pull_times[image] = known
        return known

    def pod_bound(self, pod: SimPod, node: SimNode) -> None:
        """Pull what is missing, then start the pod's containers."""
        now = self._timeline.now()
        images_ready = now
        for image in pod.images:
            present = node.images.get(image)
            if present is None:
                start = max(now, node.pull_free_at) if self.config.serialize_image_pulls else now
                present = start + self.pull_time(image).sample(self._rng)
                node.images[image] = present
                if self.config.serialize_image_pulls:
                    node.pull_free_at = present
                self.counters.image_pulls += 1
            images_ready = max(images_ready, present)
        if self.config.start_limit is not None:
            self._timeline.at(images_ready, partial(self._want_slot, pod, node, images_ready))
            return
        running_at = images_ready + self.config.container_start.sample(self._rng)
        self._timeline.at(running_at, lambda: self._start(pod, node))

    def pod_terminating(self, pod: SimPod, grace_s: float) -> None:
        """SIGTERM now; the pod is gone when it exits or its grace runs out."""
        if self._starting.pop(pod, None) is not None:
            # A start-up stopped gives its slot on at once.
            self._next_slots(self._timeline.now())
        stop_s = min(grace_s, self.config.shutdown.sample(self._rng))
        self._timeline.after(stop_s, lambda: self._finish(pod))

    # -- start-up slots (`start_limit`) --------------------------------------------------------
    #
    # Slot times are kept exact, off the grid: a start that holds its slot a tenth of a
    # second hands it on a tenth of a second later, however coarse the ticks that run it.

    def _want_slot(self, pod: SimPod, node: SimNode, ready_t: float) -> None:
        """The pod's images are there (since `ready_t`): start it in a free slot, else
        queue it."""
        self._queued.append((pod, node, ready_t))
        self._next_slots(ready_t)

    def _next_slots(self, free_t: float) -> None:
        """Hand the slots free since `free_t` to the queue's head (skipping pods gone)."""
        limit = self.config.start_limit or 0
        while self._queued and len(self._starting) < limit:
            pod, node, ready_t = self._queued.popleft()
            if pod.gone or pod.terminating or pod.node is not node:
                continue
            begin = max(free_t, ready_t)
            start_s = self.config.container_start.sample(self._rng)
            hold_s = self.config.start_hold_s
            release_t = begin + (start_s if hold_s is None else min(hold_s, start_s))
            self._starting[pod] = release_t
            self._timeline.at(release_t, partial(self._slot_done, pod))
            self._timeline.at(begin + start_s, partial(self._start, pod, node))

    def _slot_done(self, pod: SimPod) -> None:
        release_t = self._starting.pop(pod, None)
        if release_t is not None:  # else stopped while it started: its slot went on then
            self._next_slots(release_t)

    def _start(self, pod: SimPod, node: SimNode) -> None:
        if pod.gone or pod.terminating or pod.node is not node or pod.phase != PodPhase.PENDING:
            return
        delay = self.config.ready_delay.sample(self._rng)
        self.counters.pods_started += 1
        pod.server.set_pod_status(
            pod.name, phase=PodPhase.RUNNING, ready=delay <= 0, pod_ip=node.next_pod_ip()
        )
        if delay > 0:
            self._timeline.after(delay, lambda: self._ready(pod, node))

    def _ready(self, pod: SimPod, node: SimNode) -> None:
        if pod.gone or pod.terminating or pod.node is not node:
            return
        pod.server.set_pod_status(pod.name, ready=True)

    def _finish(self, pod: SimPod) -> None:
        if not pod.gone:
            pod.server.finish_deletion(pod.name)
